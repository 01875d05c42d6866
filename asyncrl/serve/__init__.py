"""`asyncrl serve`: the builtin torch engine behind SGLang's native and OpenAI's HTTP APIs, a CPU
stand-in for an SGLang server (tests, small models, machines without SGLang).

`server.py` holds the endpoints (one `ROUTES` table) over the APIs of `asyncrl.api` (SGLang's
`/generate`, OpenAI's `/v1/*` over the same jobs) and the HTTP of `asyncrl.web`. The SGLang
engine backend that drives such servers is `asyncrl.sglang`; the only piece shared with it is
the weight-update group formation (`asyncrl.sglang.publisher`), because both ends of SGLang's
collective weight sync must form the group with the same call.
"""
