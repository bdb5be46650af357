"""The old place of :mod:`ringcomm.device.standin`, kept so that
``ringcomm.standin.standin_array`` (named by earlier READMEs and scripts) keeps working."""

from ringcomm.device.standin import STANDIN, StandinArray, standin_array

__all__ = ["STANDIN", "StandinArray", "standin_array"]
