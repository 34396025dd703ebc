# The embedded fixture models live in the top-level fixtures/ folder and are
# installed as the package `divergence.fixtures`, so a plain (non-editable)
# `pip install` finds them from any directory. pyproject.toml can't express
# "find packages + map one extra folder", hence this file.
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["divergence", "divergence.*"]) + ["divergence.fixtures"],
    package_dir={"divergence.fixtures": "fixtures"},
)
