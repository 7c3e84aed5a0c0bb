"""Models the library did not write, used as a new user would bring them: unchanged code, no sharding in it."""
