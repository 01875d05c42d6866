"""Weight sync between trainer rank 0 and the rollout workers (DESIGN §7).

The seam: `base` (the `WeightPublisher` / `WeightSubscriber` Protocols and the background
publisher and subscriber the transports build on), `config` and `fields` (torch-free: configs
validate without torch), and the transports it owns, `broadcast` and `store`. SGLang's transport
is a member of its own package (`asyncrl.sglang.publisher`); the roles choose one
(`asyncrl.trainer.backends`, `asyncrl.rollout.backends`). Importing the package loads nothing.
"""
