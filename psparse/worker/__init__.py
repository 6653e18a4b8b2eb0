"""A worker's side of a run: the PS client, one round on the host or the GPU, and the session a
training loop holds.

* the client: ``client.py`` (registration, heartbeats, propose/push/aggregate, reports),
  ``sharded_client.py`` (S key-range shards);
* a round: ``round.py`` (``Round``, written once, and the host's engine), ``exchange.py`` (the
  round shapes, clock and context), ``parts.py`` and ``buckets.py`` (buckets of layers,
  ``--overlap``), ``device_round.py`` and ``device_copy.py`` (the GPU's engine),
  ``flat_model.py`` (the model's flat buffers), ``amp.py`` (``GradScaler``);
* the seam: ``session.py`` (``Session``), ``session_state.py`` (its checkpoint),
  ``connection.py`` (``psparse.connect``), ``environment.py`` (rank, world size, server from
  the environment), ``lifecycle.py`` (the run's length, ``stop()``, the misuses),
  ``optimizers.py`` (several optimizers as one);
* what a run can record: ``recall.py`` (``--probe-recall``), ``selections.py``
  (``--record-selections``).
"""
