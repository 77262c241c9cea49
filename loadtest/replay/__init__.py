"""`kvgate replay`: workloads replayed live (over HTTP) or offline (in simulated time)."""
