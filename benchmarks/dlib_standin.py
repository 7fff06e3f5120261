"""A stand-in for dlib's 68-point shape predictor, of the published file's sizes, for timing dlib's tracker where
that file cannot go (it is 100 MB): cascade depth 10, trees of depth 5, 500 a level, a feature pool of 400,
trained for a second on random images. Its landmarks mean nothing; its cost per face is the real one's order
(on a 2-core CPU 0.25 ms against 0.40 ms; the face detector, dlib's own, is the bulk of tracking).

    python benchmarks/dlib_standin.py OUT.dat
"""

import sys
import time

import dlib
import numpy as np

rng = np.random.default_rng(0)
images, faces = [], []
for _ in range(4):
    images.append((rng.random((256, 256)) * 255).astype(np.uint8))
    points = [dlib.point(int(x), int(y)) for x, y in rng.uniform(60, 196, (68, 2))]
    faces.append([dlib.full_object_detection(dlib.rectangle(50, 50, 206, 206), points)])
options = dlib.shape_predictor_training_options()
options.cascade_depth, options.tree_depth, options.num_trees_per_cascade_level = 10, 5, 500
options.feature_pool_size, options.nu, options.num_threads = 400, 0.1, 1  # dlib-bin crashes with more threads
t = time.perf_counter()
dlib.train_shape_predictor(images, faces, options).save(sys.argv[1])
print(f"stand-in 68-point predictor trained in {time.perf_counter() - t:.1f} s: {sys.argv[1]}")
