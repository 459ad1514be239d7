import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` of the bench scripts: the module docstring as written, and each option's default (none shown
    for flags, whose default is off, and options whose default is None or empty)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == "":
            return action.help
        return super()._get_help_string(action)
