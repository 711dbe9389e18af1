"""``torch.nn.functional`` of the stub: empty."""


def __getattr__(name):
    raise AttributeError(f"torch.nn.functional.{name} is not in the rknn venv's torch stub")
