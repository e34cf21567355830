"""Other formats in and out: Hugging Face, torch.distributed.checkpoint (DCP), DeepSpeed."""
