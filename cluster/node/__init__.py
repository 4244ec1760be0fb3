"""What this node runs: how its GPUs are split (placement), which engine and trainer (selection), the tested GPU
stack, and vLLM and the trainer sharing one GPU."""
