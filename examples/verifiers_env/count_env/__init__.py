from count_env.taskset import CountEnv, CountTaskset

__all__ = ["CountEnv", "CountTaskset"]
