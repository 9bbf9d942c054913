"""User-facing measurement jobs: `capture` (what capture costs) and `profile` (the configuration matrix).

Import the submodules directly (`qeffect.profile.matrix`, `.report`, `.flops`, `.resources`, `.plot`);
this package imports nothing heavy, so `import qeffect.profile` stays cheap.
"""
