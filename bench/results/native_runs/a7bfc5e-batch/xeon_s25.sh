#!/bin/bash
# device: the issue-15 batch sweeps (MNIST, KJV) with the final tree, three rounds, best of 5 runs per configuration
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .dev/whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
cp .dev/kjv.hdf5 /tmp/kjv.hdf5
ONLY='tqvec-ivf 4b residual|tqvec-ivf 4b direct|rabitqlib|turbovec 4b'
for r in 1 2 3; do
  mkdir -p /tmp/res$r && cp .dev/seed/*.json /tmp/res$r/
  S="python3 -m tqvec.bench.sweep --runs 5 --out /tmp/res$r --update --batch --threads 16"
  uptime > /tmp/res$r/load.txt
  $S --dataset mnist-784-euclidean --only "$ONLY" > /tmp/res$r/mnist_batch.log 2>&1
  $S --dataset /tmp/kjv.hdf5 --only "$ONLY" > /tmp/res$r/kjv_batch.log 2>&1
  uptime >> /tmp/res$r/load.txt
  for f in /tmp/res$r/*.md; do echo "== $r $f"; sed -n '/## Best/,/## Plots/p' $f | grep -E "rabitq|tqvec|turbovec" | head -4 | cut -d'|' -f2,5,6; done
done
tar czf $OUT/res.tgz -C /tmp res1 res2 res3
