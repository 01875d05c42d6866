"""Episodes: what one episode does, top to bottom, whatever runs it. `base.py` (what every
episode speaks in: `Turns`, `EpisodeFailed`, `EpisodeKind`), `record.py` (its token record,
`TokenRecord`), `environment.py` (an environment episode). An agent's episode is
`asyncrl.agents.episode`; a one-turn episode needs no coroutine and stays on the generating
thread (`asyncrl.rollout.scheduler`)."""
