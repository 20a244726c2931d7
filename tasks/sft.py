"""Supervised fine-tuning: ``python -m tasks.sft [key=value ...]`` (or under torchrun)."""

from tasks.runner import task_main
from veoptim.objectives import SFTConfig

main = task_main("sft", SFTConfig)

if __name__ == "__main__":
    main()
