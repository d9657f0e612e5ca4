"""Shim for tools that still call setup.py; metadata lives in setup.cfg.

Only the package list is here: the top-level policies/ folder stays where it is in the repository and
is installed as the package-data package ``dynamix_hvd.policies`` (setup.cfg cannot add a package
from outside the package tree to ``find:``). The lab (bench/: simulator, pretraining, calibration,
benchmark jobs and suites) is not installed; it runs from the source tree.
"""
from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["dynamix_hvd", "dynamix_hvd.*"]), "dynamix_hvd.policies"],
    package_dir={"dynamix_hvd.policies": "policies"},
    package_data={"dynamix_hvd.policies": ["*.pt", "*.json", "*.md", "*.csv", "*.png"]},
)
