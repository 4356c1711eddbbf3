"""Rank processes on torch.distributed: the tensor-parallel group and how ranks start."""
