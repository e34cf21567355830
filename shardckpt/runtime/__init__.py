"""The ZeRO-1/2/3 training runtime on torch.distributed."""
