"""Lightning callbacks (quantized-state checkpoints, optimizer-step profiler, fidelity monitor).
Empty until the callbacks issue lands."""
