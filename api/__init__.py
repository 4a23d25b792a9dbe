"""The Python API: ways into cargohold from a user's own training code.

:class:`~cargohold.api.trainer.Trainer` runs the whole machinery on a user's model
factory, loss and data (``cargohold train`` is a thin layer over it, the one place below
that imports this package).

:class:`~cargohold.api.optimizer.OffloadedAdamW` is a ``torch.optim.Optimizer`` whose
AdamW state lives on state servers; :func:`~cargohold.api.servers.start_state_servers`
and :func:`~cargohold.api.servers.connect_state_servers` give it servers. The package
root re-exports them (``cargohold.OffloadedAdamW``). This layer sits on top: it imports
``cargohold.services`` and ``cargohold.cluster``, and nothing there imports it but the
CLI's ``train`` command.
"""
