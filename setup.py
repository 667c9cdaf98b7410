"""The package list: everything under src/, plus the top-level native/ (CUDA sources) as axkern._native.

The rest of the configuration is in pyproject.toml; a package mapped from outside src/ needs an
explicit package list, which find_packages keeps complete as ops are added.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages("src"), "axkern._native"],
    package_dir={"": "src", "axkern._native": "native"},
)
