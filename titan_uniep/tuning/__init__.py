"""Tuning a UniEP layer: the space of ``LayerParams`` points and which of
their fields keep the bits (``space``), an analytic model of a point's time
per stage on a GPU (``model``), and the measurement of the model's hardware
constants (``calibrate``)."""
