"""CLI subcommands (each module registers its own with ``layerleap.cli.command``)."""
