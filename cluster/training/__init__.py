"""Training: trajectories to token sequences, the one GRPO loss, the trainers (PEFT, Unsloth), a step as a
transaction."""
