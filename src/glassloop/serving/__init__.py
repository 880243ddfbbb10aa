"""The model where it is served: exported as an ONNX file or a ``torch.export`` program, each
checked against the model at export (``glassloop export --format onnx|torch-export``,
:func:`glassloop.export_onnx`, :func:`glassloop.export_program`), and an ONNX file run on raw
inputs by onnxruntime without torch (``glassloop predict model.onnx``)."""
