"""The embedded native inference engine (pure PyTorch, CPU and GPU).

`engine.NativeEngine` is the model + continuous-batching scheduler; `server.create_app` serves it
over SGLang's native HTTP protocol; `python -m slime.engines.native` runs it standalone
(`cli.py`: its flags). Importing this package imports nothing else.
"""
