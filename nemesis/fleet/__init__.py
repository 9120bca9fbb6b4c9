"""A fleet: replicas of one ``nemesis run`` configuration sharing one state store.

- ``port``: the state store's port (members, assignments, live overrides,
  the generation) and its values;
- ``core``: the store logic over SQL, once; ``sqlite``: the SQLite store,
  only its queries (the kind is registered in ``nemesis.backends``);
- ``placement``: who should run which integration (rendezvous hashing);
- ``plan``: what one member does after a look at the store (start, wait,
  release, shares), a pure function of what it sees;
- ``member``: one replica's part (lease, overrides), beside the proxy; it
  carries the plan out;
- ``status``: what ``nemesis fleet status`` and ``GET /fleet`` show;
- ``revocations``: the DLQ viewer's signed-out sessions, shared by every
  replica through the store (each kind's statements, the logic once).

Nothing here is imported by ``nemesis.config``; import the modules you need.
"""
