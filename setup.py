"""Package discovery for the three importable trees; everything else is in pyproject.toml.

``src/deltasync`` is the library. Its applications install beside it under their own names:
the top-level ``examples/`` folder as ``deltasync_examples`` (the demo, the RL demo, the
in-cluster job) and ``bench/`` as ``deltasync_bench`` (every benchmark program). pyproject.toml
cannot map a folder to a package of another name and still discover its subpackages, so the
mapping lives here.
"""

from setuptools import find_packages, setup

APPS = {"deltasync_examples": "examples", "deltasync_bench": "bench"}

packages = find_packages("src")
for name, folder in APPS.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir={"": "src", **APPS})
