"""Direct preference optimisation: ``python -m tasks.dpo [key=value ...]`` (or under torchrun)."""

from tasks.runner import task_main
from veoptim.objectives import DPOConfig

main = task_main("dpo", DPOConfig)

if __name__ == "__main__":
    main()
