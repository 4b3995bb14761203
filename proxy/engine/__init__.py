"""The proxy's side of the engine connection (``protocol`` messages over ZeroMQ).

| module | what |
|---|---|
| ``client`` | ``EngineClient`` (the interface the app is given) and ``ZmqEngineClient`` |
| ``stream`` | ``RequestStream``: the bounded per-request event stream the client hands out |
"""
