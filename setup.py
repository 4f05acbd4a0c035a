from setuptools import setup

# Dataflow workers build this package from here (--setup_file); the metadata lives in pyproject.toml.
setup()
