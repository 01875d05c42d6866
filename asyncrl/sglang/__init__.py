"""Everything that knows SGLang: its config, HTTP client, engine, weight publisher and the CPU
stand-in server behind `asyncrl serve`. Nothing here imports SGLang itself."""
