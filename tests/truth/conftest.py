"""tests/truth runs torch single-threaded (the kit's ``one_torch_thread``): its tensors are tiny."""

from kit import one_torch_thread  # noqa: F401 - a fixture: pytest finds it by name here
