"""Training: optimizer and schedule, the step, evaluation, the loop."""
