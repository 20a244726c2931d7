"""Which packages the distribution ships, and under which names (the rest is pyproject.toml).

The checkout keeps ``tasks/``, ``callbacks/`` and ``configs/`` at its top (``python -m tasks.sft``), but a
wheel must not claim such generic top-level names in a user's site-packages, where they
would collide with the user's own ``tasks`` or ``callbacks``: they ship inside the veoptim
namespace, as ``veoptim.tasks`` and ``veoptim.callbacks`` (``package_dir`` maps the
directories at build time). Their modules import each other relatively, and the two
places that cross from tasks to callbacks pick the name by ``__package__``.
"""

from setuptools import find_packages, setup

#: installed package -> its directory in the checkout
RENAMED = {"veoptim.tasks": "tasks", "veoptim.callbacks": "callbacks"}
#: the checkout's top-level Hydra configs ship as package data of ``veoptim.configs``
#: (pyproject.toml's package-data), where an installed task command looks for them
CONFIGS = {"veoptim.configs": "configs"}

packages = find_packages(include=["veoptim", "veoptim.*"])
for name, directory in RENAMED.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(directory)]
packages += list(CONFIGS)

setup(packages=packages, package_dir={**RENAMED, **CONFIGS})
