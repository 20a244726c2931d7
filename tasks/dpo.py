"""Direct preference optimisation: ``python -m tasks.dpo [key=value ...]`` (or under torchrun)."""

from veoptim.objectives import DPOConfig

from .runner import task_main

main = task_main("dpo", DPOConfig)

if __name__ == "__main__":
    main()
