"""The judge stage: turning runs into evidence.

- ``baseline``: the BF16 baseline run (served or in process) and its seal;
- ``gate``: collapse signatures and the baseline-calibrated envelope, per image;
- ``compare``: PSNR / SSIM against the sealed baseline, the parity band and each fixture's decision;
- ``stats``: the intervals and decisions behind every answer.
"""
