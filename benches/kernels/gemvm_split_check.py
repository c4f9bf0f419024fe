#!/usr/bin/env python3
# An emulation of the work split of kernels/gemv_mma.cu (split tiles finished from shares
# published mid-stream; written for it, in Python, where each rule can be checked): per warp, the
# fetch and consume cursors over its range with a ring of RING steps (tiles last first, each in
# column order), the segments it stores whole, publishes, or finishes. Checks, for the 27B shape's
# launches and 3,000 random shapes (and rings of 3 and 4): every step consumed once, in the order
# fetched; a round of the ring ends at most one segment before the last; every tile stored exactly
# once with its steps in column order (shares added in warp order); every published share read by
# its finisher, which only reads earlier warps.
#
#   python3 benches/kernels/gemvm_split_check.py
import random
def owner(a,S,TW): return ((a+1)*TW+S-1)//S-1
def run(tiles, spt, TW, RING=2):
    S=tiles*spt
    published={}  # gw -> (tile, steps)
    stored={}     # tile -> list of steps summed in order
    fin_reads={}
    events=[]
    for gw in range(TW):
        i0=gw*S//TW; i1=(gw+1)*S//TW
        t_first=i0//spt; t_last=(i1-1)//spt if i1>i0 else t_first
        sb=lambda t: i0-t*spt if t==t_first else 0
        se=lambda t: i1-t*spt if t==t_last else spt
        # fetch cursor
        ft,fs,fe,fi=t_last,sb(t_last),se(t_last),i0
        fetched=[]
        def fetch():
            nonlocal ft,fs,fe,fi
            if fi>=i1: return
            if fs==fe:
                ft-=1; fs=sb(ft); fe=spt
            fetched.append((ft,fs)); fs+=1; fi+=1
        for u in range(RING): fetch()
        # consume
        acc=[];accn=[]
        ct,cs,ce,i=t_last,sb(t_last),se(t_last),i0
        k=0
        while i<i1:
            crossed=False
            for u in range(RING):
                if i>=i1: break
                step=fetched[k]; k+=1
                assert step==((ct-1) if crossed else ct, cs), (gw, step, ct, cs, crossed)
                (accn if crossed else acc).append(step)
                fetch()
                i+=1
                cs+=1
                if cs==ce and i<i1:
                    assert not crossed, "two crossings in a round"
                    crossed=True; cs=sb(ct-1); ce=spt
            if crossed:
                # finish_mid
                t=ct
                assert all(s[0]==t for s in acc)
                if t*spt+se(t)==(t+1)*spt:
                    assert sb(t)==0 and len(acc)==spt
                    assert t not in stored; stored[t]=[("w",gw,acc)]
                else:
                    assert gw not in published; published[gw]=(t,acc)
                acc=accn; accn=[]; ct-=1
        if i0<i1:
            t=ct
            assert all(s[0]==t for s in acc), (gw,t,acc)
            lo=t*spt+sb(t); hi=t*spt+se(t)
            assert lo==max(i0,t*spt)
            # As the kernel's `finish`: a segment that starts the tile or ends before it
            # does is done as `finish_mid` does (whole: stored; else published).
            if sb(t)==0 or se(t)<spt:
                if se(t)==spt:
                    assert lo==t*spt and hi==(t+1)*spt
                    assert t not in stored; stored[t]=[("w",gw,acc)]
                else:
                    assert hi<(t+1)*spt
                    assert gw not in published; published[gw]=(t,acc)
            else:
                wf=owner(t*spt,S,TW)
                fin_reads[t]=(wf,gw,acc)
    # finishers
    for t,(wf,gw,acc) in fin_reads.items():
        parts=[]
        for w in range(wf,gw):
            assert w in published and published[w][0]==t, (t,w,published.get(w))
            parts+=published[w][1]
            published[w]=None
        parts+=acc
        assert t not in stored; stored[t]=parts
    # every tile stored, every publish consumed, steps complete and in k order
    assert sorted(stored)==list(range(tiles)), (len(stored),tiles)
    assert all(v is None for v in published.values())
    for t,v in stored.items():
        steps=v[0][2] if isinstance(v[0],tuple) and v[0][0]=="w" else v
        assert [s[1] for s in steps]==list(range(spt)), (t,steps)
random.seed(1)
cases=[(2176,40,2112),(320,136,2112),(1030,40,2112),(320,48,2112),(3,32,24),(19,4,16),(13,6,16),(15520,40,2112)]
for _ in range(3000):
    spt=random.randint(2,60); tiles=random.randint(1,400)
    S=tiles*spt; TW=random.randint(1,max(1,S//4))
    cases.append((tiles,spt,TW))
for c in cases: run(*c)
print("ok", len(cases))
random.seed(2)
for _ in range(2000):
    ring = random.choice([3, 4])
    spt = random.randint(ring, 60); tiles = random.randint(1, 300)
    S = tiles * spt; TW = random.randint(1, max(1, S // 4))
    run(tiles, spt, TW, ring)
print("ok: rings of 3 and 4")
