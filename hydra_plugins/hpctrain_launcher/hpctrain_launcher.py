"""hpctrain's Hydra launchers (Hydra only loads launcher plugins from the hydra_plugins package).

The behaviour lives in hpctrain/launch/submit.py; these classes bind it to hydra-submitit-launcher's.
"""

from hydra_plugins.hydra_submitit_launcher import submitit_launcher as plugin

from hpctrain.launch.submit import Submitting


class SlurmLauncher(Submitting, plugin.SlurmLauncher):
    """hydra/launcher=slurm"""


class LocalLauncher(Submitting, plugin.LocalLauncher):
    """hydra/launcher=local"""
