"""Grammar checks at the HTTP edge: a ``response_format`` or tool grammar is checked
before the request reaches the worker, in a child process bounded in time and memory.

| module | what |
|---|---|
| ``check`` | ``GrammarChecker`` (the pool of children), ``validate``, the JSON-schema grammar |
| ``child`` | the child process (``python -m proxy.grammar.child MEMORY_MB``) |
"""
