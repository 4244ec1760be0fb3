"""What runs on the GPU node (or this machine): the cluster server, its engines and trainers, checkpoints."""
