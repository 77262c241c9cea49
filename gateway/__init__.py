"""kvgate's HTTP edge: OpenAI routes, admin API, proxying, upstream pool, scraping, tenancy."""
