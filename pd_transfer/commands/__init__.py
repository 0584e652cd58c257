"""What the ``pd-transfer`` subcommands run: ``serve``, the demo, ``check``/``plan`` reports, ``status`` tables."""
