"""The config schema: one typed ``TrainConfig`` (:mod:`.train`) with a dataclass per
section, loaded from YAML with ``key.path=value`` overrides (:mod:`.io`). Unknown keys and
ill-typed values are refused with the full dotted key in the message. The services import
these values and nothing else of ``cargohold.cluster``; the launcher, CLI and plan sit
above them. :mod:`.reference` renders docs/configuration.md from the docstrings here."""
