"""Subprocess scripts and shared payload helpers of the checkpoint publication tests."""
