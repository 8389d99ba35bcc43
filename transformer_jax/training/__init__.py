"""Training: the loop, its jitted steps, the checks before a run, fine-tuning, checkpoint
averaging, metric writers, preemption, and compiling the steps ahead of time for other targets."""
