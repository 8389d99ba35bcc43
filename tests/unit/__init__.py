"""In this process, no run trained and no process started: the model, the decoder, the data
readers, the layout; the quick edit loop draws most of its tests from here."""
