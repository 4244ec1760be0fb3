"""Inference: the OpenAI `/v1` surface, the engines behind it (portable, vLLM), the device gate between sampling and
adapter swaps."""
