"""The vLLM replica simulator, workload generators, replay and benchmarks."""
