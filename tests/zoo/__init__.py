"""A model zoo: families the project did not write, each in its own file as its users write it (no sharding
in it), trained by ``test_zoo.py`` under every layout that applies."""
