"""Supervised fine-tuning: ``python -m tasks.sft [key=value ...]`` (or under torchrun)."""

from veoptim.objectives import SFTConfig

from .runner import task_main

main = task_main("sft", SFTConfig)

if __name__ == "__main__":
    main()
