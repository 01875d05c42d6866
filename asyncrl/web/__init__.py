"""HTTP for every server of asyncrl's: how a request is read, checked and answered, whatever it
means. `auth.py` (the run's shared secret: where it is read from, loopback-only without one,
the key checked from a request's head), `aio.py` (the hardened asyncio HTTP/1.1 server of
`asyncrl env-server` and `asyncrl agent-server`: request limits, read deadlines, a connection
cap, descriptor backoff), `threaded.py` (JSON, text and server-sent events over the standard
library's threaded server, which `asyncrl serve` and the agent gateway run on; `ApiError`),
`serving.py` (a command's foreground, and starting one as a child). What a request means is
the caller's: SGLang's and OpenAI's APIs are `asyncrl.api`."""
