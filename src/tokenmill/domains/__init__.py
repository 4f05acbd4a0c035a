"""Topic domains found in the corpus itself (issue 20): `tokenmill domains train` fits spherical k-means
over document embeddings of a sample and coarsens the fine clusters into domains `c00`..; the curate stage
`domain_clusters` (tokenmill.domains.stage) places every document in one, so that cells are cNN x quality.
"""
