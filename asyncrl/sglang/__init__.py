"""Everything that knows SGLang: its config, HTTP client, engine and weight publisher. Nothing here
imports SGLang itself. The CPU stand-in server behind `asyncrl serve` is `asyncrl.serve`."""
