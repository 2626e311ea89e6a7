"""The run directory: its layout and the metrics file that every part writes to."""
