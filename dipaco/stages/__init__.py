"""One file per `dipaco <command>`, commands only; what several commands share is in `dipaco.pipeline`.
Stages do not import each other.
"""
